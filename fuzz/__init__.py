"""Fuzzing harnesses (atheris, libFuzzer for Python): one module per harness, run by `make fuzz`.

Each harness module exposes `check(data: bytes) -> None`, which raises `AssertionError`
(`harness.SlowInput` for an input that took superlinear time) when the broker breaks one of
the invariants, and runs as an atheris script: `python -m fuzz.NAME [libFuzzer flags] [CORPUS]`.
`check` imports without atheris: tests/test_fuzz_regressions.py replays files through it.
"""
