"""A stand-in for `vllm._custom_ops`: one function, never called.

SGLang 0.5.23's `RotaryEmbedding.__init__` (`layers/rotary_embedding/base.py`)
imports `vllm._custom_ops.rotary_embedding` as its fallback kernel on any
device that is not CUDA, HIP or SGLang's CPU engine, keeps it as
`fallback_rotary_embedding`, and then, on a plain CPU server, runs
`forward_native` instead. So the import must succeed and the function is
never reached; if SGLang ever calls it, it raises, naming this file.
"""

from __future__ import annotations

from typing import Any


def rotary_embedding(*args: Any, **kwargs: Any) -> None:
    raise NotImplementedError(
        "tests/sglang/standins/vllm/_custom_ops.py is a stand-in: SGLang's CPU rotary layer is expected to run "
        "forward_native, not vLLM's kernel"
    )
