"""Where vLLM is installed, prepare its offline CPU environment before any test imports it."""

from __future__ import annotations

from . import _env

if _env.vllm_missing() is None:
    _env.prepare()
