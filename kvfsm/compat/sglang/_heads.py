"""Unequal attention tensor parallelism for the Mooncake trio: who pairs with whom, and which bytes go where.

With MHA/GQA and attention TP, each rank holds `total_kv_heads / attn_tp_size`
of the KV heads: a KV buffer (one per layer and per K/V) is `[tokens,
local_heads, head_dim]`, and SGLang's page is `page_size` consecutive token
rows. When the prefill and the decode run different attention TP sizes, a
decode rank's rows are made of head slices of several prefill ranks (prefill
TP 2, decode TP 1: each decode row is prefill rank 0's heads then rank 1's),
or a prefill rank's rows feed several decode ranks (prefill TP 1, decode TP 2:
decode rank 0 takes the first half of each row, rank 1 the second). SGLang's
own Mooncake backend does the same (`send_kvcache_slice`: one write per
token row of each page and layer, `compute_head_slice_params` for the
offsets); this module is kvfsm's version of that arithmetic, sans-IO:

* `TPLayout`: what a rank tells its peers in its engine session (its
  attention TP size and rank, page size, head counts);
* `pairing(prefill, decode)`: which prefill ranks a decode rank pulls from,
  and which slot of a prefill rank's fan-out it is, or why the pair cannot
  work (a refusal the request fails with);
* `head_slices(src, dst, ...)` and `sliced_writes(...)`: per KV region, the
  byte offset and length each token row moves, and the engine writes of a
  chunk (adjacent writes merged, so equal layouts still move whole runs).

What is refused, with a reason naming it: TP sizes that do not divide each
other, KV heads that do not divide over the larger TP size (SGLang
replicates heads across ranks then; kvfsm does not), MLA (replicated latent
KV) with a larger prefill TP than decode TP, and layouts whose head size,
dtype, page size or buffer count differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ...backends.memory import KVPools, MemoryRegion

__all__ = ["TPLayout", "Pairing", "HeadSlice", "pairing", "head_slices", "sliced_writes", "slicing_problem", "sub_room"]

#: The key of a rank's layout in its engine session fields.
SESSION_FIELD = "sglang"


def _positive(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TPLayout.{attribute.name} must be an int >= 1; got {value!r}")


def _optional_positive(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _positive(instance, attribute, value)


@attrs.frozen(slots=True)
class TPLayout:
    """One rank's KV layout as its peers see it.

    `tp_rank` is the rank within its attention TP group (SGLang's
    `engine_rank % attn_tp_size`). `total_kv_heads` and `local_kv_heads`
    are None for MLA (one latent KV per token, the same on every rank).
    """

    attn_tp_size: int = attrs.field(validator=_positive)
    tp_rank: int = attrs.field()
    page_size: int = attrs.field(validator=_positive)
    total_kv_heads: int | None = attrs.field(default=None, validator=_optional_positive)
    local_kv_heads: int | None = attrs.field(default=None, validator=_optional_positive)

    @tp_rank.validator
    def _check_rank(self, _attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.attn_tp_size:
            raise ValueError(f"TPLayout.tp_rank must be an int in [0, {self.attn_tp_size}); got {value!r}")

    @property
    def mla(self) -> bool:
        return self.total_kv_heads is None

    def fields(self) -> dict[str, int | None]:
        return attrs.asdict(self)

    @classmethod
    def from_fields(cls, value: object) -> TPLayout | None:
        """The layout a peer sent, or None when it sent none or a malformed one (then it pairs page for page)."""
        if not isinstance(value, dict):
            return None
        fields: dict[str, Any] = value
        try:
            return cls(
                attn_tp_size=fields["attn_tp_size"],
                tp_rank=fields["tp_rank"],
                page_size=fields["page_size"],
                total_kv_heads=fields.get("total_kv_heads"),
                local_kv_heads=fields.get("local_kv_heads"),
            )
        except (KeyError, TypeError, ValueError):
            return None


def sub_room(room: Any, index: int) -> str:
    """The id of the `index`-th extra room of a request (a str: SGLang's own rooms are ints, so no clash)."""
    return f"{room}/tp{index}"


@attrs.frozen(slots=True)
class Pairing:
    """How one decode rank meets a prefill server of another TP size.

    `prefill_ranks`: the prefill attention TP ranks this decode rank pulls
    from (one room each, the first is the request's own room). `slot`: this
    decode rank's place among the decode ranks one prefill rank feeds (0 when
    it is alone; slot k > 0 claims the prefill's room `sub_room(room, k)`).
    `fan_out`: how many decode ranks each prefill rank feeds.
    """

    prefill_ranks: tuple[int, ...]
    slot: int = 0
    fan_out: int = 1


def pairing(prefill_tp: int, decode: TPLayout, prefill_total_heads: int | None) -> Pairing | str:
    """The prefill ranks decode rank `decode.tp_rank` pulls from, or why it cannot (a refusal's text)."""
    decode_tp = decode.attn_tp_size
    if prefill_tp == decode_tp:
        return Pairing((decode.tp_rank,))
    sizes = f"prefill attention TP {prefill_tp}, decode {decode_tp}"
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        return f"kvfsm's Mooncake backend pairs TP sizes that divide each other; got {sizes}"
    if decode.mla != (prefill_total_heads is None):
        return f"one side has MLA KV and the other per-head KV ({sizes})"
    if decode.mla:
        if prefill_tp > decode_tp:
            return (
                f"kvfsm's Mooncake backend does not pull MLA KV from a prefill with more TP ranks than the decode "
                f"({sizes}): SGLang's dummy senders are not implemented"
            )
    else:
        assert prefill_total_heads is not None and decode.total_kv_heads is not None
        if prefill_total_heads != decode.total_kv_heads:
            return f"the prefill has {prefill_total_heads} KV heads, the decode {decode.total_kv_heads}"
        if decode.total_kv_heads % max(prefill_tp, decode_tp):
            return (
                f"{decode.total_kv_heads} KV heads do not divide over {max(prefill_tp, decode_tp)} ranks ({sizes}): "
                "replicated KV heads are not supported"
            )
    if prefill_tp > decode_tp:
        ratio = prefill_tp // decode_tp
        return Pairing(tuple(range(decode.tp_rank * ratio, (decode.tp_rank + 1) * ratio)))
    ratio = decode_tp // prefill_tp
    return Pairing((decode.tp_rank // ratio,), slot=decode.tp_rank % ratio, fan_out=ratio)


@attrs.frozen(slots=True)
class HeadSlice:
    """What each token row of one KV region moves: `length` bytes from `src_offset` to `dst_offset`."""

    src_row: int
    dst_row: int
    src_offset: int
    dst_offset: int
    length: int


def _heads_of(layout: TPLayout) -> int:
    return 1 if layout.local_kv_heads is None else layout.local_kv_heads


def slicing_problem(src: TPLayout, dst: TPLayout, src_pools: KVPools, dst_pools: KVPools) -> str | None:
    """Why a prefill rank (`src`) cannot write head slices into a decode rank (`dst`), or None."""
    sizes = f"prefill attention TP {src.attn_tp_size}, decode {dst.attn_tp_size}"
    if src.page_size != dst.page_size:
        return f"page size {src.page_size} on the prefill, {dst.page_size} on the decode ({sizes})"
    if len(src_pools.kv) != len(dst_pools.kv):
        return f"{len(src_pools.kv)} KV buffers on the prefill, {len(dst_pools.kv)} on the decode ({sizes})"
    for index, (mine, theirs) in enumerate(zip(src_pools.kv, dst_pools.kv, strict=True)):
        if mine.dtype is not None and theirs.dtype is not None and mine.dtype != theirs.dtype:
            return f"KV buffer {index}: dtype {mine.dtype} on the prefill, {theirs.dtype} on the decode"
        src_head = mine.page_nbytes // src.page_size // _heads_of(src)
        dst_head = theirs.page_nbytes // dst.page_size // _heads_of(dst)
        if src_head * src.page_size * _heads_of(src) != mine.page_nbytes or src_head != dst_head:
            return (
                f"KV buffer {index}: {mine.page_nbytes} bytes per page for {_heads_of(src)} heads on the prefill, "
                f"{theirs.page_nbytes} for {_heads_of(dst)} on the decode: the heads are not the same size ({sizes})"
            )
    if len(src_pools.aux) != len(dst_pools.aux) or any(
        mine.page_nbytes != theirs.page_nbytes for mine, theirs in zip(src_pools.aux, dst_pools.aux, strict=True)
    ):
        return "the metadata slots differ between the prefill and the decode"
    return None


def head_slices(
    src: TPLayout, dst: TPLayout, src_kv: Sequence[MemoryRegion], dst_kv: Sequence[MemoryRegion]
) -> list[HeadSlice]:
    """Per KV region, the slice of each token row prefill rank `src` writes into decode rank `dst`.

    SGLang's `compute_head_slice_params` without head replication: a
    prefill rank with fewer heads than the decode rank sends all of them
    into its part of the decode's row; one with more sends the decode
    rank's part of its row; MLA rows are whole on both sides.
    """
    slices = []
    for mine, theirs in zip(src_kv, dst_kv, strict=True):
        src_row, dst_row = mine.page_nbytes // src.page_size, theirs.page_nbytes // dst.page_size
        if src.mla:
            slices.append(HeadSlice(src_row, dst_row, 0, 0, src_row))
            continue
        head = src_row // _heads_of(src)
        src_heads, dst_heads = _heads_of(src), _heads_of(dst)
        if src_heads <= dst_heads:  # fan-in (or equal): all of ours, at our place in their row
            dst_start = (src.tp_rank * src_heads) % dst_heads
            slices.append(HeadSlice(src_row, dst_row, 0, dst_start * head, src_heads * head))
        else:  # fan-out: their part of our row
            src_start = (dst.tp_rank * dst_heads) % src_heads
            slices.append(HeadSlice(src_row, dst_row, src_start * head, 0, dst_heads * head))
    return slices


def sliced_writes(
    src_kv: Sequence[MemoryRegion],
    dst_kv: Sequence[MemoryRegion],
    slices: Sequence[HeadSlice],
    page_size: int,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
) -> list[tuple[int, int, int]]:
    """The engine writes (src address, dst address, bytes) of one chunk: one per token row and region, merged.

    Region outermost, then pages, then rows: writes that continue each other
    on both sides (whole rows of consecutive pages) merge into one.
    """
    writes: list[tuple[int, int, int]] = []
    for mine, theirs, cut in zip(src_kv, dst_kv, slices, strict=True):
        for src_page, dst_page in zip(src_pages, dst_pages, strict=True):
            src_base = mine.ptr + src_page * mine.page_nbytes + cut.src_offset
            dst_base = theirs.ptr + dst_page * theirs.page_nbytes + cut.dst_offset
            for row in range(page_size):
                src, dst = src_base + row * cut.src_row, dst_base + row * cut.dst_row
                if writes:
                    last_src, last_dst, length = writes[-1]
                    if last_src + length == src and last_dst + length == dst:
                        writes[-1] = (last_src, last_dst, length + cut.length)
                        continue
                writes.append((src, dst, cut.length))
    return writes
