"""tests/sglang's figures: what the real-server and unequal-TP tests measured, printed at the end of the run.

A test that measures something (tokens compared, requests, KV usage before
and after, time to fail) records one line with the `figures` fixture; the
lines are printed in the terminal summary, so CI's log carries them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

_FIGURES: list[str] = []


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """`figures("what was measured")`: one line of the summary, under the test's name."""

    def record(line: str) -> None:
        _FIGURES.append(f"{request.node.name}: {line}")

    return record


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES:
        terminalreporter.section("tests/sglang figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)
