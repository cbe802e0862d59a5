"""Unequal attention TP in the Mooncake trio: the pairing of ranks and the head-slice writes, byte for byte.

`kvfsm.compat.sglang._heads` is sans-IO: given each rank's `TPLayout` and
pools, it says which prefill ranks a decode rank pulls from and which bytes
of each token row go where. These tests run those writes on simulated memory
(one bytearray per KV buffer of every rank) for every TP pairing the module
accepts, and check the outcome against what a decode rank must hold: every
byte of its rows, each head from the prefill rank that computed it, the rows
of the right pages, nothing outside them touched. They also check every
refusal names what it refuses.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.backends.memory import KVPools, MemoryRegion
from kvfsm.compat.sglang._heads import (
    Pairing,
    TPLayout,
    head_slices,
    pairing,
    sliced_writes,
    slicing_problem,
    sub_room,
)

HEAD_BYTES = 6  # an odd size: offsets that are off by a head or a byte show
PAGES = 5
REGIONS = 3  # K and V of some layers: any count, all alike


class Memory:
    """Simulated memory: buffers at made-up addresses; writes are applied and checked against the buffers' bounds."""

    def __init__(self) -> None:
        self.buffers: list[tuple[int, bytearray]] = []
        self._next = 1 << 20

    def buffer(self, nbytes: int, fill: int | None = None) -> MemoryRegion:
        data = bytearray(nbytes) if fill is None else bytearray((fill + i) % 251 for i in range(nbytes))
        ptr = self._next
        self._next += nbytes + 4096  # gaps: a write past a buffer's end hits no other buffer
        self.buffers.append((ptr, data))
        return MemoryRegion(ptr, nbytes, nbytes // PAGES)

    def locate(self, address: int, length: int) -> tuple[bytearray, int]:
        for ptr, data in self.buffers:
            if ptr <= address and address + length <= ptr + len(data):
                return data, address - ptr
        raise AssertionError(f"a write of {length} bytes at {address:#x} leaves every buffer")

    def apply(self, writes: list[tuple[int, int, int]]) -> None:
        for src, dst, length in writes:
            source, src_at = self.locate(src, length)
            target, dst_at = self.locate(dst, length)
            target[dst_at : dst_at + length] = source[src_at : src_at + length]

    def read(self, region: MemoryRegion) -> bytearray:
        data, offset = self.locate(region.ptr, region.nbytes)
        return data[offset : offset + region.nbytes]


def layouts(tp: int, heads: int | None, page_size: int) -> list[TPLayout]:
    local = None if heads is None else heads // tp
    return [TPLayout(tp, rank, page_size, heads, local) for rank in range(tp)]


def pools(memory: Memory, layout: TPLayout, seed: int | None) -> KVPools:
    local = 1 if layout.local_kv_heads is None else layout.local_kv_heads
    page = layout.page_size * local * HEAD_BYTES
    return KVPools([memory.buffer(page * PAGES, None if seed is None else seed + 37 * i) for i in range(REGIONS)])


def run_pairing(prefill_tp: int, decode_tp: int, heads: int | None, page_size: int) -> None:
    """Move pages 1, 4 of every prefill rank into pages 3, 0 of every decode rank; check each decode byte."""
    memory = Memory()
    prefills = layouts(prefill_tp, heads, page_size)
    decodes = layouts(decode_tp, heads, page_size)
    src_pools = [pools(memory, layout, seed=11 * rank + 1) for rank, layout in enumerate(prefills)]
    dst_pools = [pools(memory, layout, seed=None) for layout in decodes]
    src_pages, dst_pages = [1, 4], [3, 0]
    for rank, decode in enumerate(decodes):
        plan = pairing(prefill_tp, decode, heads)
        assert isinstance(plan, Pairing), plan
        for prefill_rank in plan.prefill_ranks:
            src = prefills[prefill_rank]
            assert slicing_problem(src, decode, src_pools[prefill_rank], dst_pools[rank]) is None
            slices = head_slices(src, decode, src_pools[prefill_rank].kv, dst_pools[rank].kv)
            memory.apply(
                sliced_writes(src_pools[prefill_rank].kv, dst_pools[rank].kv, slices, page_size, src_pages, dst_pages)
            )
    total = 1 if heads is None else heads
    for rank, decode in enumerate(decodes):
        local = 1 if decode.local_kv_heads is None else decode.local_kv_heads
        for region in range(REGIONS):
            got = memory.read(dst_pools[rank].kv[region])
            row = local * HEAD_BYTES
            for page in range(PAGES):
                for token in range(page_size):
                    at = (page * page_size + token) * row
                    if page not in dst_pages:
                        assert got[at : at + row] == bytes(row), f"decode {rank}: page {page} was written"
                        continue
                    src_page = src_pages[dst_pages.index(page)]
                    for head in range(local):
                        global_head = 0 if heads is None else rank * local + head
                        owner = 0 if heads is None else global_head // (total // prefill_tp)
                        owner_heads = prefills[owner].local_kv_heads
                        owner_local = 1 if owner_heads is None else owner_heads
                        their_head = 0 if heads is None else global_head % owner_local
                        source = memory.read(src_pools[owner].kv[region])
                        s_at = ((src_page * page_size + token) * owner_local + their_head) * HEAD_BYTES
                        d_at = at + head * HEAD_BYTES
                        assert got[d_at : d_at + HEAD_BYTES] == source[s_at : s_at + HEAD_BYTES], (
                            f"decode {rank} region {region} page {page} row {token} head {head} (global {global_head})"
                        )


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "heads", "page_size"),
    [(2, 1, 4, 2), (1, 2, 4, 2), (4, 2, 8, 1), (2, 4, 8, 3), (1, 4, 4, 2), (4, 1, 4, 1), (2, 2, 4, 2)],
)
def test_every_decode_byte_comes_from_the_prefill_rank_that_computed_its_head(
    prefill_tp: int, decode_tp: int, heads: int, page_size: int
) -> None:
    run_pairing(prefill_tp, decode_tp, heads, page_size)


@given(
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([8, 16]),
    st.integers(1, 4),
)
def test_any_tp_pairing_that_is_accepted_moves_every_head(
    prefill_tp: int, decode_tp: int, heads: int, page: int
) -> None:
    run_pairing(prefill_tp, decode_tp, heads, page)


def test_mla_fans_out_whole_rows_and_refuses_to_fan_in() -> None:
    run_pairing(1, 2, None, 2)
    refusal = pairing(2, TPLayout(1, 0, 2), None)
    assert isinstance(refusal, str) and "MLA" in refusal and "prefill attention TP 2, decode 1" in refusal


def test_the_pairs_and_slots() -> None:
    decode = layouts(4, 8, 1)
    assert [pairing(2, d, 8) for d in decode] == [
        Pairing((0,), 0, 2),
        Pairing((0,), 1, 2),
        Pairing((1,), 0, 2),
        Pairing((1,), 1, 2),
    ]
    decode = layouts(1, 8, 1)
    assert pairing(4, decode[0], 8) == Pairing((0, 1, 2, 3))
    assert pairing(2, layouts(2, 8, 1)[1], 8) == Pairing((1,))
    assert sub_room(12, 1) == "12/tp1"


@pytest.mark.parametrize(
    ("prefill_tp", "decode", "prefill_heads", "expected"),
    [
        (3, TPLayout(2, 0, 1, 12, 6), 12, "divide each other; got prefill attention TP 3, decode 2"),
        (1, TPLayout(4, 0, 1, 2, 1), 2, "2 KV heads do not divide over 4 ranks"),
        (2, TPLayout(1, 0, 1, 8, 8), 4, "the prefill has 4 KV heads, the decode 8"),
        (2, TPLayout(1, 0, 1, 8, 8), None, "one side has MLA KV and the other per-head KV"),
    ],
)
def test_refusals_name_what_they_refuse(
    prefill_tp: int, decode: TPLayout, prefill_heads: int | None, expected: str
) -> None:
    refusal = pairing(prefill_tp, decode, prefill_heads)
    assert isinstance(refusal, str)
    assert expected in refusal


def test_layouts_that_cannot_slice_are_refused_at_the_handshake() -> None:
    memory = Memory()
    src, dst = TPLayout(2, 0, 2, 4, 2), TPLayout(1, 0, 2, 4, 4)
    good_src, good_dst = pools(memory, src, 1), pools(memory, dst, None)
    assert slicing_problem(src, dst, good_src, good_dst) is None
    other_page = TPLayout(1, 0, 4, 4, 4)
    assert "page size 2 on the prefill, 4 on the decode" in (slicing_problem(src, other_page, good_src, good_dst) or "")
    fewer = KVPools(good_dst.kv[:2])
    assert "3 KV buffers on the prefill, 2 on the decode" in (slicing_problem(src, dst, good_src, fewer) or "")
    wrong_heads = TPLayout(1, 0, 2, 4, 2)  # says 2 heads, but its pages hold 4 heads' bytes
    assert "the heads are not the same size" in (slicing_problem(src, wrong_heads, good_src, good_dst) or "")
    typed = KVPools([MemoryRegion(r.ptr, r.nbytes, r.page_nbytes, dtype="bfloat16") for r in good_dst.kv])
    dtyped = KVPools([MemoryRegion(r.ptr, r.nbytes, r.page_nbytes, dtype="float16") for r in good_src.kv])
    assert "dtype float16 on the prefill, bfloat16 on the decode" in (slicing_problem(src, dst, dtyped, typed) or "")


@pytest.mark.parametrize(
    "fields",
    [
        None,
        "x",
        {},
        {"attn_tp_size": 2, "tp_rank": 2, "page_size": 1},
        {"attn_tp_size": True, "tp_rank": 0, "page_size": 1},
        {"attn_tp_size": 2, "tp_rank": 0, "page_size": 0},
        {"attn_tp_size": 2, "tp_rank": 0, "page_size": 1, "total_kv_heads": -4},
    ],
)
def test_a_peers_malformed_layout_is_no_layout(fields: object) -> None:
    assert TPLayout.from_fields(fields) is None


def test_a_layout_round_trips_through_the_session() -> None:
    layout = TPLayout(4, 3, 16, 8, 2)
    assert TPLayout.from_fields(layout.fields()) == layout
    assert TPLayout.from_fields(TPLayout(2, 1, 1).fields()) == TPLayout(2, 1, 1)
