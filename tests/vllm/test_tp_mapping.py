"""Which prefill ranks a decode rank loads from, releases, and which pages it posts (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from kvfsm.compat.vllm._config import ConnectorConfig
from kvfsm.compat.vllm._params import RemoteSource
from kvfsm.compat.vllm._worker import WorkerHalf, kv_pools_by_head


def worker(rank: int, tp: int, heads: int | None) -> WorkerHalf:
    half = WorkerHalf(
        ConnectorConfig(), engine_id="E", tp_rank=rank, num_blocks=4, producer=False, consumer=True, tp_size=tp
    )
    half.page_heads = heads
    return half


def source(tp: int) -> RemoteSource:
    return RemoteSource("P", "r", "h", 9000, (1, 2), tp)


def test_equal_tp_loads_every_head_from_the_same_rank() -> None:
    assert worker(1, 2, 4)._sources(source(2)) == [(1, 0, 4)]
    assert worker(1, 2, None)._sources(source(2)) == [(1, 0, 0)]


def test_a_decode_rank_of_a_larger_tp_size_loads_its_slice_of_one_prefill_rank() -> None:
    # Prefill TP 1 (4 heads), decode TP 2 (2 heads per rank): both ranks load from prefill rank 0,
    # each every one of its own heads (the prefill sends the slice that rank's room names).
    assert worker(0, 2, 2)._sources(source(1)) == [(0, 0, 2)]
    assert worker(1, 2, 2)._sources(source(1)) == [(0, 0, 2)]


def test_a_decode_merges_the_heads_of_k_prefill_ranks_into_their_slices() -> None:
    # Decode TP 2 with 4 heads per rank, prefill TP 4 (2 heads per rank): rank 1 holds global heads 4..7.
    half = worker(1, 2, 4)
    assert half._sources(source(4)) == [(2, 0, 2), (3, 2, 2)]
    # Pages: block * heads + head; prefill rank 3's two heads land in heads 2 and 3 of each block.
    assert half._pages((5, 9), 2, 2) == [22, 23, 38, 39]


@pytest.mark.parametrize(
    ("remote", "local", "heads", "why"),
    [
        (4, 2, None, "head-major KV cache layout"),
        (3, 2, 4, "a whole number of prefill ranks"),
        (8, 1, 4, "a whole number of prefill ranks"),  # 8 ranks cannot each give a share of 4 heads
    ],
)
def test_what_cannot_be_merged_says_why(remote: int, local: int, heads: int | None, why: str) -> None:
    problem = worker(0, local, heads)._sources(source(remote))
    assert isinstance(problem, str) and why in problem


@pytest.mark.parametrize(
    ("remote", "local", "told"),
    [(2, 2, [[0], [1]]), (1, 2, [[0], []]), (4, 2, [[0, 2], [1, 3]]), (3, 2, [[0, 2], [1]]), (2, 1, [[0, 1]])],
)
def test_every_prefill_rank_is_told_to_free_by_exactly_one_decode_rank(
    remote: int, local: int, told: list[list[int]]
) -> None:
    got = [[rank for rank, _, _ in worker(r, local, None)._releases(source(remote))] for r in range(local)]
    assert got == told
    assert sorted(p for ranks in got for p in ranks) == list(range(remote))


def test_head_pages_need_a_head_major_layout() -> None:
    blocks, heads = 4, 2
    head_major = {"a": torch.zeros(blocks, heads, 16, 2, 8)}
    pools = kv_pools_by_head(head_major, blocks, heads)
    assert pools is not None and pools.num_pages == blocks * heads
    assert pools.page_nbytes * heads == head_major["a"][0].numel() * 4
    k_v_apart = {"a": torch.zeros(2, blocks, heads, 16, 8)}
    split = kv_pools_by_head(k_v_apart, blocks, heads)
    assert split is not None and len(split.kv) == 2 and split.num_pages == blocks * heads
    # A layout whose second axis is not the heads (e.g. LBNHC) has no per-head pages.
    assert kv_pools_by_head({"a": torch.zeros(blocks, 16, heads, 8)}, blocks, heads) is None
    assert kv_pools_by_head({"a": [torch.zeros(blocks, 8)]}, blocks, heads) is None


def test_a_hybrid_mamba_layer_registers_its_buffer_once_with_the_attention_layer_that_shares_it() -> None:
    # vLLM's hybrid layout: an attention layer and a Mamba layer view one raw buffer, block-major;
    # the Mamba layer's value is a list of state views (conv, ssm) with the block's page stride.
    from kvfsm.compat.vllm._worker import kv_pools

    blocks, page = 4, 256  # floats per block
    raw = torch.zeros(blocks * page)
    attention = raw.view(blocks, 2, 16, 2, 4)  # [blocks, K/V, block size, heads, head size]
    conv = torch.as_strided(raw, (blocks, 3, 8), (page, 8, 1))
    ssm = torch.as_strided(raw, (blocks, 4, 16), (page, 16, 1), storage_offset=24)
    pools = kv_pools({"attn": attention, "mamba": [conv, ssm]}, blocks)
    assert len(pools.kv) == 1 and pools.num_pages == blocks and pools.page_nbytes == page * 4
    # State views of another buffer than their layer's first one are refused by name.
    other = torch.zeros(blocks, 3, 8)
    from kvfsm import ConfigError

    with pytest.raises(ConfigError, match="'mamba'"):
        kv_pools({"mamba": [conv, other]}, blocks)
