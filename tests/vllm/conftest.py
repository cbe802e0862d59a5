"""Where vLLM is installed, prepare its offline CPU environment before any test imports it.

Also the `engines` fixture the in-process engine tests share.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from . import _env

if _env.vllm_missing() is None:
    _env.prepare()

_engine_ids = itertools.count()


@pytest.fixture
def engines() -> Iterator[Callable[..., Any]]:
    """`engines(kv_role, **kwargs)` makes a `harness.Engine` (unique id); each is shut down after the test."""
    from .harness import Engine  # imports vLLM: only the tests that ask for engines need it

    made: list[Engine] = []

    def make(kv_role: str, **kwargs: Any) -> Engine:
        engine = Engine(kv_role, f"{kv_role}-{next(_engine_ids)}", **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()
