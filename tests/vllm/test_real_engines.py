"""Real vLLM engines, a prefill and decodes, each a `vllm.LLM` in its own process, KV moved by kvfsm.

What is real: vLLM 0.33.0's offline engine end to end (engine core,
scheduler, KV cache manager with prefix caching, the CPU model runner and
attention backend, OPT's model code, the greedy sampler) and the kvfsm
connector on both roles with the KV moved over Mooncake (TCP on
127.0.0.1). What is stood in (`llm_peer`, `cpu_ops`): the model is a
two-layer OPT with dummy weights re-drawn from a seed in every process;
prompts are token ids; the compiled CPU ops (memory env init, slot mapping,
reshape-and-cache, attention with KV cache, greedy argmax) are pure torch.
The attention stand-in reads every key and value from the KV cache blocks,
so a decode's tokens depend on the KV it loaded: a prefill with other
weights must change them (the negative control).

Four engines start at once and serve every test of this module: the
prefill (seed 1), a decode with `kv_load_failure_policy="fail"`, one with
`"recompute"` (both opt in to `on_drain_deadline="release"`), and a
prefill with other weights (seed 2) that is killed half way. Each call is
bounded; every process is stopped at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from . import _env

_missing = _env.vllm_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)

from ..integration.remote_peer import engine_missing, free_port  # noqa: E402
from .llm_peer import BLOCK_SIZE, LLMPeer  # noqa: E402

TOKENS = 6
COMMON: dict[str, Any] = {"backend": "mooncake", "heartbeat_interval": 0.2, "bootstrap_timeout": 8, "drain_timeout": 4}


class Engines:
    def __init__(self) -> None:
        self.prefill = LLMPeer("prefill", seed=1, kv_role="kv_producer", extra={**COMMON, "port": free_port()})
        self.other = LLMPeer("prefill-other", seed=2, kv_role="kv_producer", extra={**COMMON, "port": free_port()})
        # A killed prefill proves nothing, so by default its loads' blocks stay quarantined and
        # their requests wait (tests/unit/test_release_phase.py checks that on the worker half).
        # These decodes opt in to the timer release, so that vLLM's two failure policies run.
        decode = {**COMMON, "on_drain_deadline": "release"}
        self.decode = LLMPeer("decode", seed=1, kv_role="kv_consumer", extra=decode, policy="fail")
        self.recompute = LLMPeer("decode-recompute", seed=1, kv_role="kv_consumer", extra=decode, policy="recompute")
        self.all = [self.prefill, self.other, self.decode, self.recompute]

    def stop(self) -> None:
        for peer in self.all:
            peer.stop()


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    missing = engine_missing("mooncake")
    if missing:
        pytest.skip(missing)
    started = Engines()
    try:
        for peer in started.all:
            peer.ready()
        yield started
    finally:
        started.stop()


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50000 + 10 for i in range(length)]


def reference(engines: Engines, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of a single instance (the prefill engine, no transfer)."""
    return [out["tokens"] for out in engines.prefill.generate([(p, TOKENS, None) for p in prompts])]


def remote_prefill(peer: LLMPeer, prompts: list[list[int]]) -> list[dict[str, Any]]:
    outs = peer.generate([(p, 1, {"do_remote_decode": True}) for p in prompts])
    params = [out["kv_transfer_params"] for out in outs]
    assert all(p is not None and p["do_remote_prefill"] for p in params)
    return params


def test_a_decode_generates_a_single_instances_greedy_tokens(engines: Engines) -> None:
    prompts = [prompt(1, 70), prompt(2, 3 * BLOCK_SIZE), prompt(3, 33)]
    expected = reference(engines, prompts)
    params = remote_prefill(engines.prefill, prompts)
    before = engines.decode.info()["worker"]
    outs = engines.decode.generate([(p, TOKENS, q) for p, q in zip(prompts, params, strict=True)])
    assert [out["tokens"] for out in outs] == expected
    assert all(out["finish_reason"] == "length" for out in outs)
    info = engines.decode.info()
    after = info["worker"]
    assert after["loaded"] - before["loaded"] == 3 and after["failed_loads"] == before["failed_loads"]
    # vLLM's CPU attention keeps blocks head-major (LBHNC): the connector moved one page per KV head.
    assert info["page_heads"] == 4


def test_a_decode_that_caches_the_prefix_loads_only_the_tail(engines: Engines) -> None:
    prefix = prompt(4, 2 * BLOCK_SIZE)
    first, second = [*prefix, *prompt(5, 20)], [*prefix, *prompt(6, 25)]
    expected = reference(engines, [first, second])
    for tokens, want, blocks in ((first, expected[0], 2 + 1), (second, expected[1], 1)):
        (params,) = remote_prefill(engines.prefill, [tokens])
        before = engines.decode.info()["worker"]
        (out,) = engines.decode.generate([(tokens, TOKENS, params)])
        after = engines.decode.info()["worker"]
        assert out["tokens"] == want
        # The second request's first two blocks are the decode's own cached prefix: only its tail moves.
        assert after["loaded"] - before["loaded"] == 1
        assert after["blocks_loaded"] - before["blocks_loaded"] == blocks


def test_a_prefill_with_other_weights_changes_the_decodes_tokens(engines: Engines) -> None:
    # The negative control: were the decode computing the prompt itself, its tokens would not change.
    tokens = prompt(7, 80)
    (expected,) = reference(engines, [tokens])
    (params,) = remote_prefill(engines.other, [tokens])
    (out,) = engines.decode.generate([(tokens, TOKENS, params)])
    assert out["finish_reason"] == "length"
    assert out["tokens"] != expected


def test_a_dead_prefill_fails_the_load_or_is_recomputed_as_the_policy_says(engines: Engines) -> None:
    fail, recompute = prompt(8, 50), prompt(9, 60)
    (expected,) = reference(engines, [recompute])
    params = remote_prefill(engines.other, [fail, recompute])
    engines.other.kill()
    (failed,) = engines.decode.generate([(fail, TOKENS, params[0])])
    assert failed["finish_reason"] == "error" and failed["tokens"] == []
    (recomputed,) = engines.recompute.generate([(recompute, TOKENS, params[1])])
    assert recomputed["finish_reason"] == "length" and recomputed["tokens"] == expected
    for peer in (engines.decode, engines.recompute):
        worker = peer.info()["worker"]
        assert worker["failed_loads"] >= 1
