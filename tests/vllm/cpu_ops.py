"""Pure-torch stand-ins for the compiled ops vLLM's CPU path calls, so a real `LLM` runs here.

vLLM 0.33.0's wheel on the package index is a CUDA build: it has no CPU
ops extension (`vllm._C` with the CPU kernels) and, in these tests'
venv, no triton. Everything else of a real engine is vLLM's own code
(engine core, scheduler, KV cache manager, the CPU model runner and its
attention backend, OPT's model code, the sampler, the KV connector).
`install()` puts in place, in this process only:

* `torch.ops._C.init_cpu_memory_env`: the CPU worker's NUMA memory set-up (nothing to do here);
* the slot mapping (`vllm.v1.worker.block_table._COMPUTE_SLOT_MAPPING_KERNEL`, a triton kernel):
  token position -> `block_id * block_size + offset`, no context parallelism;
* `torch.ops._C.get_scheduler_metadata`: the CPU attention kernel's work split (unused by the stand-in);
* `torch.ops._C.cpu_attn_reshape_and_cache`: each new token's K and V written to its slot;
* `torch.ops._C.cpu_attention_with_kv_cache`: causal attention of each request's queries over the
  K and V it reads back from its blocks (grouped heads, scale; no alibi, sinks or soft cap);
* `torch.ops._C.greedy_argmax`: the sampler's greedy pick.

The attention reads every key and value from the KV cache blocks, never
from the current forward's inputs, so a decode whose blocks came from a
prefill computes with the prefill's KV: that is what the engine tests check.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_installed = False


def _init_cpu_memory_env(nodes: list[int]) -> None:
    return None


def _get_scheduler_metadata(*args: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int32)


def _reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *args: Any,
) -> None:
    # key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_size] (views).
    block_size = key_cache.shape[2]
    slots = slot_mapping[: key.shape[0]].tolist()
    for token, slot in enumerate(slots):
        if slot < 0:
            continue  # padding
        block, offset = divmod(slot, block_size)
        key_cache[block, :, offset] = key[token]
        value_cache[block, :, offset] = value[token]


def _attention_with_kv_cache(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    block_table: torch.Tensor,
    softcap: float,
    *args: Any,
) -> None:
    if alibi_slopes is not None or (softcap and softcap > 0):
        raise NotImplementedError("the attention stand-in has no alibi or soft cap")
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    out = output.view(-1, num_heads, head_size)
    starts = query_start_loc.tolist()
    for request, seq_len in enumerate(seq_lens.tolist()):
        begin, end = starts[request], starts[request + 1]
        if end <= begin:
            continue
        blocks = block_table[request, : math.ceil(seq_len / block_size)].long()
        # [blocks, heads, block_size, head] -> [tokens, heads, head]
        keys = key_cache[blocks].permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_size)[:seq_len]
        values = value_cache[blocks].permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_size)[:seq_len]
        group = num_heads // num_kv_heads
        keys = keys.repeat_interleave(group, dim=1).float()
        values = values.repeat_interleave(group, dim=1).float()
        q = query[begin:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        positions = torch.arange(seq_len - (end - begin), seq_len)
        keys_at = torch.arange(seq_len)
        mask = torch.zeros(end - begin, seq_len, dtype=torch.bool)
        if causal:
            mask |= keys_at[None, :] > positions[:, None]
        if sliding_window is not None and sliding_window > 0:
            mask |= keys_at[None, :] <= positions[:, None] - sliding_window
        scores = scores.masked_fill(mask[None], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out[begin:end] = torch.einsum("hqk,khd->qhd", weights, values).to(out.dtype)


def _greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1).view(-1)


class _SlotMapping:
    """`ComputeSlotMappingKernel` without triton: slot = block id * block size + offset."""

    def register_warmup(self, **kwargs: Any) -> None:
        return None

    def __call__(
        self,
        num_reqs: int,
        num_tokens: int,
        max_num_tokens: int,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        block_table_stride: int,
        slot_mapping: torch.Tensor,
        kv_cache_block_size: int,
        total_cp_world_size: int,
        total_cp_rank: int,
        cp_kv_cache_interleave_size: int,
    ) -> None:
        if total_cp_world_size != 1:
            raise NotImplementedError("the slot-mapping stand-in has no context parallelism")
        slot_mapping[num_tokens:max_num_tokens] = -1
        starts = query_start_loc.tolist()
        for request in range(num_reqs):
            begin, end = starts[request], starts[request + 1]
            pos = positions[begin:end].long()
            blocks = block_table[request].long()[pos // kv_cache_block_size]
            slot_mapping[begin:end] = blocks * kv_cache_block_size + pos % kv_cache_block_size


def install() -> None:
    """Put the stand-ins in place (idempotent); call before vLLM builds an engine."""
    global _installed
    if _installed:
        return
    from vllm.v1.worker import block_table

    ops = torch.ops._C
    for name, fn in (
        ("init_cpu_memory_env", _init_cpu_memory_env),
        ("get_scheduler_metadata", _get_scheduler_metadata),
        ("cpu_attn_reshape_and_cache", _reshape_and_cache),
        ("cpu_attention_with_kv_cache", _attention_with_kv_cache),
        ("greedy_argmax", _greedy_argmax),
    ):
        setattr(ops, name, fn)
    block_table._COMPUTE_SLOT_MAPPING_KERNEL = _SlotMapping()  # type: ignore[assignment,unused-ignore]
    _installed = True
