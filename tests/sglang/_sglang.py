"""Importing the real SGLang (0.5.23) for these tests, or skipping with the reason.

Every module of tests/sglang starts with `sglang_or_skip()`: where SGLang is
not installed (the main test environment), the module is skipped and pytest
prints why; CI runs this folder in a second environment that has it (see
.ci/run). SGLang's modules are imported by name so that mypy, which runs
without SGLang, sees them as `Any`.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from typing import Any

import pytest

from kvfsm.compat.sglang import SGLANG_VERSION

SKIP_REASON = f"SGLang {SGLANG_VERSION} is not installed here; CI runs tests/sglang in its own environment (.ci/run)"


def sglang_or_skip() -> None:
    """Skip the calling test module unless the pinned SGLang is importable."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(SKIP_REASON, allow_module_level=True)
    installed = module("sglang").__version__
    if installed != SGLANG_VERSION:
        pytest.skip(f"SGLang {installed} is installed; these tests pin {SGLANG_VERSION}", allow_module_level=True)


def module(name: str) -> Any:
    """An SGLang module, imported quietly (it warns about missing GPU kernels on CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)
