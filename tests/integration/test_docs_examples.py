"""The code in the guides runs: each python block is executed and its test cases run."""

from __future__ import annotations

import re
import unittest
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

GUIDES = Path(__file__).resolve().parents[2] / "docs" / "guides"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(name: str) -> list[str]:
    return BLOCK.findall((GUIDES / name).read_text(encoding="utf-8"))


@pytest.mark.parametrize("index", range(len(python_blocks("conformance-kit.md"))))
def test_conformance_kit_guide_examples_run(index: int) -> None:
    pytest.importorskip("torch", reason="the guide's example uses LocalBackend (torch)")
    namespace: dict[str, Any] = {"__name__": f"conformance_kit_example_{index}"}
    exec(compile(python_blocks("conformance-kit.md")[index], f"conformance-kit.md[{index}]", "exec"), namespace)
    cases = [value for name, value in namespace.items() if name.startswith("Test") and isinstance(value, type)]
    assert cases, "each example defines a test case"
    for case in cases:
        assert issubclass(case, unittest.TestCase)
        runnable: Any = case
        runnable.settings = settings(max_examples=10, stateful_step_count=20)
        runnable("runTest").runTest()
