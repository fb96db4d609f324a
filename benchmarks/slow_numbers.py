"""CPU seconds `Method.bind` takes on a MiB of numbers msgspec reads slowly (`1e308`, halfway floats) and of ordinary ones.

Usage: .venv/bin/python benchmarks/slow_numbers.py [--against TREE] [--rounds 3] [--only TEXT]

Binds each case's params (about 1 MiB; the batch case: 127 params of 8 KiB, as one batch's
calls reach a worker) to a method of tests/apps/bignums.py, the best of `--rounds`, in a
child process per tree (this one, and `--against TREE`: another checkout, e.g. a `git
worktree` of main, whose `broker` package is imported instead), and prints the CPU seconds
(process time) side by side with what the binding said. Hostile testing, rounds 136 (F2) and
137 (F1, F2, F3, F5, F9); broker/floats.py. Prints figures only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
MIB = (1 << 20) - 100
HALFWAY = b"1.2345000000000000576e249"  # (midway between two doubles: msgspec's fallback, 6 us)


def _array(token: bytes, size: int = MIB) -> bytes:
    return b"[" + b",".join([token] * ((size - 1) // (len(token) + 1))) + b"]"


def _named(token: bytes, tail: bytes = b"") -> bytes:
    return b'{"values": ' + _array(token, MIB - 16 - len(tail))[:-1] + tail + b"]}"


# (the midpoint of float64's max and 2**1024, less one, in digits: no exponent, msgspec's fallback)
_WRITTEN_OUT = str((int(sys.float_info.max) + 2**1024) // 2 - 1).encode() + b".0"


def _honest() -> bytes:  # (F9: 600 of float64's max as a "missing" sentinel among 1,400 floats)
    rng = random.Random(9)
    values = [rng.uniform(-50, 50) for _ in range(1400)] + [sys.float_info.max] * 600
    rng.shuffle(values)
    return json.dumps(values).encode()


CASES: dict[str, tuple[str, list[bytes]]] = {
    "1.5 to total(list[float])": ("total", [b"[" + _array(b"1.5", MIB - 2) + b"]"]),
    "small ints to ints(list[int])": ("ints", [b"[" + _array(b"7", MIB - 2) + b"]"]),
    "tool args (strings, ints, floats) to untyped": ("untyped", [json.dumps([[
        {"query": f"report {i}", "limit": i % 50, "score": i / 8, "tags": ["a", "b"]} for i in range(14000)]]).encode()]),
    "1.5 to mark(tag: str) (refused)": ("mark", [_array(b"1.5")]),
    "1e308 to total(list[float])": ("total", [b"[" + _array(b"1e308", MIB - 2) + b"]"]),
    "1e308 to mark (refused)": ("mark", [_array(b"1e308")]),
    "halfway e249 to total(list[float])": ("total", [b"[" + _array(HALFWAY, MIB - 2) + b"]"]),
    "halfway e249 to mark (refused)": ("mark", [_array(HALFWAY)]),
    "halfway e-300 to untyped": ("untyped", [b"[" + _array(b"1.2345000000000000451e-300", MIB - 2) + b"]"]),
    "1e23 to untyped": ("untyped", [b"[" + _array(b"1e23", MIB - 2) + b"]"]),
    "halfway e249 to points(list[Point])": ("points", [b"[" + _array(b'{"x":' + HALFWAY + b"}", MIB - 2) + b"]"]),
    "F5 halfway + 1e1000 to ints (refused)": ("ints", [_named(HALFWAY, b",1e1000")]),
    "F5 halfway + 1e1000 to untyped (refused)": ("untyped", [_named(HALFWAY, b",1e1000")]),
    "F5 1.5 + 1e400 to total (refused)": ("total", [_named(b"1.5", b",1e400")]),
    "F2 batch: 127 x 8 KiB of 1e308 to total": ("total", [b"[" + _array(b"1e308", 8187) + b"]"] * 127),
    "F3 1 MiB of digits in a string + a 42-digit number": ("untyped", [b'[["' + b"31415926535" * 95000 + b'", '
                                                                        + b"1" * 41 + b'.5]]']),
    "F9 honest: 600 float64 max of 2,000 to star": ("star", [_honest()]),
    "139 F6 one 1e400 after a MiB of [1] to untyped (refused)": ("untyped", [_named(b"[1]", b",[[1e400]]")]),
    "140 F1 1e308 to kwpriced(Decimal, **list[float])": ("kwpriced", [b'{"price": 1.5, "a": ' + _array(b"1e308", MIB - 30) + b"}"]),
    "140 F2 65,000 keys 1.Ne300 to weights(dict[float, int])": ("weights", [b"[{" + b", ".join(b'"1.%de300": 1' % i for i in range(65000)) + b"}]"]),
    "139 F4 1e308 to priced(Decimal, list[float])": ("priced", [b"[1.5, " + _array(b"1e308", MIB - 10) + b"]"]),
    "139 F4 1e308 to wrapped(Raw, list[float])": ("wrapped", [b"[{}, " + _array(b"1e308", MIB - 10) + b"]"]),
    "140 F8 1e308 to dfs(list[DF]), DF a Struct of a Decimal and a float": ("dfs", [
        b"[" + _array(b'{"d":1,"f":1e308}', MIB - 2) + b"]"]),
    "140 F8 halfway e249 to dfs(list[DF])": ("dfs", [b"[" + _array(b'{"d":1,"f":' + HALFWAY + b"}", MIB - 2) + b"]"]),
    "140 F8 batch: 55 x 1000 DF of 1e308 to dfs": ("dfs", [b"[[" + b",".join([b'{"d":1,"f":1e308}'] * 1000) + b"]]"] * 55),
    "1e308 to decimals(list[Decimal]) (msgspec reads those fast)": ("decimals", [b"[" + _array(b"1e308", MIB - 2) + b"]"]),
    "1.5e-3 to dfs(list[DF])": ("dfs", [b"[" + _array(b'{"d":1,"f":1.5e-3}', MIB - 2) + b"]"]),
    "halfway below max written out (310 digits) to total": ("total", [b"[" + _array(_WRITTEN_OUT, MIB - 2) + b"]"]),
}

_CHILD = """
import importlib.util, json, sys, time
from broker.worker.params import Method
rounds, name, app = int(sys.argv[1]), sys.argv[2], sys.argv[3]
all_params = json.loads(sys.stdin.buffer.read())
spec = importlib.util.spec_from_file_location("bignums", app)
bignums = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bignums)
method = Method(name, getattr(bignums, name))
best, said = float("inf"), "bound"
for _ in range(rounds):
    t = time.process_time()
    for params in all_params:
        try:
            method.bind(params.encode("latin-1"), 64)
        except Exception as exc:
            said = f"{type(exc).__name__} {str(exc)[:70]}"
    best = min(best, time.process_time() - t)
print(json.dumps([best, said]))
"""


def bind_seconds(tree: Path, name: str, params: list[bytes], rounds: int) -> tuple[float, str]:
    """Best CPU seconds of `rounds` binds of each of `params` to bignums' `name`, importing `tree`'s broker."""
    env = dict(os.environ, PYTHONPATH=str(tree))  # (the app from this tree, by its path)
    app = str(HERE / "tests" / "apps" / "bignums.py")
    given = json.dumps([p.decode("latin-1") for p in params]).encode()
    out = subprocess.run([sys.executable, "-c", _CHILD, str(rounds), name, app], input=given, env=env,
                         capture_output=True, check=True, cwd=tree).stdout
    best, said = json.loads(out)
    return best, said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another checkout to bind with, side by side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="the cases whose label holds this text")
    args = parser.parse_args()
    for label, (name, params) in CASES.items():
        if args.only not in label:
            continue
        size = sum(map(len, params))
        here, said = bind_seconds(HERE, name, params, args.rounds)
        line = f"{label:50} {size:>8} B  this tree {here:6.3f} s  {said}"
        if args.against is not None:
            there, said_there = bind_seconds(args.against, name, params, args.rounds)
            line += f"\n{'':61} against   {there:6.3f} s  {said_there}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
