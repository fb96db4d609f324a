"""An app with a method whose parameter is hinted with a plain class, which msgspec cannot
decode from JSON: its registration is refused (tests/test_check_app.py)."""

from broker.worker import Registry

registry = Registry()


class Point:
    def __init__(self, x: float, y: float) -> None:
        self.x, self.y = x, y


@registry.method
def add(a: int, b: int = 2) -> int:
    return a + b


@registry.method
def norm(origin: int, p: Point) -> float:
    return float((p.x**2 + p.y**2) ** 0.5) - origin
