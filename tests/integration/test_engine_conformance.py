"""The conformance kit over the real cross-process engines: Mooncake and NIXL.

Each engine's adapter is run as a third-party adapter would be (see
docs/guides/conformance-kit.md): a sender and a receiver endpoint on
127.0.0.1, talking over the real ZeroMQ control plane and moving bytes
with the engine over loopback TCP. The pair factories and their `settle()`
live in `tests.integration.engine_kit`.

Mooncake runs in this process. NIXL cannot: importing it into the pytest
process crashes the interpreter at exit, so the same kit runs in a child
process (`python -m tests.integration.engine_kit nixl EXAMPLES STEPS`) that
reports through its exit status and output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from .remote_peer import engine_missing

pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")
pytest.importorskip("torch", reason="torch is needed for the KV pools")

from .engine_kit import MooncakeConformance

ROOT = Path(__file__).resolve().parents[2]
# Each step waits for loopback round trips: a fixed, modest budget whatever the profile
# (about 10 s per engine here).
EXAMPLES, STEPS = 100, 30
CHILD_LIMIT = 600


MOONCAKE_MISSING = engine_missing("mooncake")

TestMooncakeBackend = pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=str(MOONCAKE_MISSING))(
    MooncakeConformance.TestCase
)
TestMooncakeBackend.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None)


def test_nixl_backend_in_a_child_process() -> None:
    if (why := engine_missing("nixl")) is not None:
        pytest.skip(why)
    child = subprocess.run(
        [sys.executable, "-m", "tests.integration.engine_kit", "nixl", str(EXAMPLES), str(STEPS)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=CHILD_LIMIT,
    )
    passed = f"conformance kit over nixl: {EXAMPLES} examples passed"
    # The child's traceback (hypothesis' falsifying example included) is the failure message.
    assert child.returncode == 0 and passed in child.stdout, child.stderr[-20000:]
