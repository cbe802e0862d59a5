"""A stand-in for vLLM, for SGLang servers on CPU in tests/sglang (see `_custom_ops`)."""
