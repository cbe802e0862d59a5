"""The process environment vLLM's scheduler needs on CPU, without any network.

vLLM builds a `ModelConfig` from a Hugging Face model name; the tests use
facebook/opt-125m (as vLLM's own tests do) and ship only its config.json,
installed here into a private offline hub cache. The real engines run
`TINY`, an OPT of two layers and four heads of 64 (the CPU attention's
smallest head size) under a local name, config only: their weights are
dummies, re-seeded in every process (`llm_peer`). Must run before vLLM is
imported (its settings are read at import time).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

MODEL = "facebook/opt-125m"
TINY = "kvfsm-test/tiny-opt"
_CONFIGS = {
    MODEL: Path(__file__).with_name("opt-125m-config.json"),
    TINY: Path(__file__).with_name("tiny-opt-config.json"),
}
_REVISION = "0" * 40


def vllm_missing() -> str | None:
    """Why vLLM cannot be used here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed in this environment (.ci/run builds a venv with vllm==0.33.0 and runs these there)"
        )
    return None


def prepare() -> Path:
    """Point Hugging Face at an offline cache holding MODEL's config; CPU platform. Idempotent."""
    existing = os.environ.get("KVFSM_TEST_HUB")
    if existing:
        return Path(existing)
    hub = Path(tempfile.mkdtemp(prefix="kvfsm-hub-"))
    atexit.register(shutil.rmtree, hub, True)
    for model, config in _CONFIGS.items():
        repo = hub / ("models--" + model.replace("/", "--"))
        snapshot = repo / "snapshots" / _REVISION
        snapshot.mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(_REVISION)
        shutil.copy(config, snapshot / "config.json")
    os.environ.update(
        {
            "KVFSM_TEST_HUB": str(hub),
            "HF_HUB_CACHE": str(hub),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_TARGET_DEVICE": "cpu",
        }
    )
    return hub
