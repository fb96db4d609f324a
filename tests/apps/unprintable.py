"""An app whose import raises an exception that cannot be printed (tests/test_lifecycle.py)."""


class Weird(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message for you")


raise Weird()
