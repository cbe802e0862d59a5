"""Tests of `kvfsm.compat.vllm`; those that need vLLM skip (saying why) where it is absent."""
