"""pytest plugin: vLLM 0.33.0's own KV-connector lifecycle tests, run with the kvfsm connector.

    python -m tests.vllm.fetch_upstream            # once: extracts them to build/vllm-upstream
    python -m pytest -p tests.vllm.upstream_plugin build/vllm-upstream/vllm_upstream_tests/v1/kv_connector/unit

`KVFSM_UPSTREAM_CONNECTOR=nixl` runs the same files with vLLM's own
NixlConnector instead, the baseline they were written for.

Every adaptation made to vLLM's tests lives here (the files themselves
are vLLM's, unchanged but for their package name):

1. `utils.create_vllm_config` defaults to `kv_connector="KVFSMConnector"`
   and `kv_connector_module_path="kvfsm.compat.vllm"` instead of
   `"NixlConnector"`; a test naming its own connector keeps it.
2. The environment: CPU platform, Hugging Face offline with a hub cache
   holding only facebook/opt-125m's config.json (`_env.prepare`).
3. vLLM's `cpu_test` marker is registered (this repository runs pytest
   with `--strict-markers`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from . import _env

_env.prepare()

CONNECTOR = os.environ.get("KVFSM_UPSTREAM_CONNECTOR", "kvfsm")
_UTILS = "vllm_upstream_tests.v1.kv_connector.unit.utils"


def _select_kvfsm(utils: Any) -> None:
    create = utils.create_vllm_config
    names = create.__code__.co_varnames[: create.__code__.co_argcount]
    defaults = list(create.__defaults__)
    first = len(names) - len(defaults)
    chosen = {"kv_connector": "KVFSMConnector", "kv_connector_module_path": "kvfsm.compat.vllm"}
    for name, value in chosen.items():
        defaults[names.index(name) - first] = value
    create.__defaults__ = tuple(defaults)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_test: vLLM's marker of tests that run on CPU")
    if CONNECTOR not in ("kvfsm", "nixl"):
        raise pytest.UsageError(f"KVFSM_UPSTREAM_CONNECTOR must be 'kvfsm' or 'nixl'; got {CONNECTOR!r}")
    # Import vLLM's test utils before its tests do, from the directory holding the package.
    for arg in config.args:
        parts = Path(arg).resolve().parts
        if "vllm_upstream_tests" in parts:
            root = str(Path(*parts[: parts.index("vllm_upstream_tests")]))
            if root not in sys.path:
                sys.path.insert(0, root)
            break
    else:
        raise pytest.UsageError("give the vllm_upstream_tests paths to run (see tests/vllm/fetch_upstream.py)")
    if CONNECTOR == "kvfsm":
        import importlib

        _select_kvfsm(importlib.import_module(_UTILS))


def pytest_report_header(config: pytest.Config) -> str:
    return f"vLLM's lifecycle tests with connector: {CONNECTOR}"
