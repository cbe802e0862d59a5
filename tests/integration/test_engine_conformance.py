"""The conformance kit over a real cross-process engine: Mooncake, both endpoints in this process.

`MooncakeBackend` is run as a third-party adapter would be (see
docs/guides/conformance-kit.md): a sender and a receiver endpoint on
127.0.0.1, talking over the real ZeroMQ control plane and moving bytes
with Mooncake Transfer Engine over loopback TCP. The pair factory and its
`settle()` live in `tests.integration.engine_kit`.

NIXL is not run here: importing it into the pytest process crashes the
interpreter at exit, so `python -m tests.integration.engine_kit nixl 5 10`
runs the same kit in a child process. It currently fails: a NIXL room with
no page to write (its completion is a standalone notification, the first
thing sent to that decode) never completes on the decode.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# Under CPU contention some cross-thread effect is not yet settled when the kit
# reads state in a precondition, and hypothesis stops with FlakyStrategyDefinition
# (4 of 5 runs failed beside a busy loop; 4 of 4 quiet runs passed). Until settle()
# is airtight it runs on demand, not in CI.
if os.environ.get("KVFSM_ENGINE_CONFORMANCE") != "1":
    pytest.skip(
        "the conformance kit over Mooncake runs on demand: set KVFSM_ENGINE_CONFORMANCE=1 "
        "(nondeterministic under CPU contention)",
        allow_module_level=True,
    )

pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")
pytest.importorskip("torch", reason="torch is needed for the KV pools")
pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine (mooncake-transfer-engine-non-cuda) is missing")

from .engine_kit import MooncakeConformance

# Each step waits for loopback round trips: a fixed, modest budget whatever the profile
# (about 10 s here with HYPOTHESIS_PROFILE=ci).
TestMooncakeBackend = MooncakeConformance.TestCase
TestMooncakeBackend.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
