"""Test helpers shared by every suite."""

from __future__ import annotations

import time
from collections.abc import Callable


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a monotonic clock never goes back"
        self.now += seconds


def until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Whether `predicate()` held within `timeout` seconds (polled every 2 ms; asked once more at the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return predicate()
