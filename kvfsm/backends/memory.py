"""What an endpoint registers, and the page lists it is handed: the memory types.

`MemoryRegion` is one registered buffer of pages (what RDMA-style engines
register: pointer, length, bytes per page); `KVPools` is every region one
endpoint registers (KV per layer and K/V, plus the aux slots), with the
layout check both sides must pass; `check_pages` validates page and aux
indices the same way for every adapter. Plain data, duck-typed over
tensors: nothing here imports torch, and the adapter protocol
(`base.py`) and the wire (`_sessions.py`) both build on it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import attrs

from ._errors import TransferInputError

__all__ = ["MemoryRegion", "KVPools", "check_pages", "as_index_list", "is_index"]


def _non_negative(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"MemoryRegion.{attribute.name} must be an int >= 0; got {value!r}")


@attrs.frozen(slots=True)
class MemoryRegion:
    """One registered buffer of pages: where it is, how long, bytes per page.

    `ptr`/`nbytes` are what RDMA-style engines register (SGLang's
    `kv_data_ptrs`/`kv_data_lens`); `page_nbytes` is the bytes one page
    occupies in this buffer (SGLang's `kv_item_lens`). Page `i` lives at
    `ptr + i * page_nbytes`. `tensor` is the buffer itself for in-process
    adapters (a torch tensor whose first dimension is the page); it is not
    compared or hashed. `dtype` is a label such as "bfloat16" used to check
    that both sides agree; `name` only helps error messages.
    """

    ptr: int = attrs.field(validator=_non_negative)
    nbytes: int = attrs.field(validator=_non_negative)
    page_nbytes: int = attrs.field(validator=_non_negative)
    device: str = "cpu"
    dtype: str | None = None
    name: str = ""
    tensor: Any = attrs.field(default=None, eq=False, hash=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.page_nbytes == 0:
            raise ValueError(f"MemoryRegion {self.name or hex(self.ptr)}: page_nbytes must be > 0")
        if self.nbytes % self.page_nbytes:
            raise ValueError(
                f"MemoryRegion {self.name or hex(self.ptr)}: nbytes {self.nbytes} is not a multiple of "
                f"page_nbytes {self.page_nbytes}"
            )

    @property
    def num_pages(self) -> int:
        return self.nbytes // self.page_nbytes

    @classmethod
    def of_tensor(cls, tensor: Any, name: str = "") -> MemoryRegion:
        """Describe a contiguous tensor whose first dimension indexes pages.

        Duck-typed (no torch import): needs `data_ptr()`, `numel()`,
        `element_size()`, `shape`, `dtype`, `device`, `is_contiguous()`.
        """
        if not tensor.is_contiguous():
            raise ValueError(f"KV buffer {name or '?'} must be contiguous; got strides {tuple(tensor.stride())}")
        if len(tensor.shape) < 1 or tensor.shape[0] == 0:
            raise ValueError(
                f"KV buffer {name or '?'} needs a first (page) dimension > 0; got shape {tuple(tensor.shape)}"
            )
        nbytes = int(tensor.numel()) * int(tensor.element_size())
        return cls(
            ptr=int(tensor.data_ptr()),
            nbytes=nbytes,
            page_nbytes=nbytes // int(tensor.shape[0]),
            device=str(tensor.device),
            dtype=str(tensor.dtype).removeprefix("torch."),
            name=name,
            tensor=tensor,
        )


def _regions(value: Iterable[MemoryRegion]) -> tuple[MemoryRegion, ...]:
    regions = tuple(value)
    for region in regions:
        if not isinstance(region, MemoryRegion):
            raise TypeError(f"KVPools takes MemoryRegion items; got {type(region).__name__}: {region!r}")
    return regions


@attrs.frozen(slots=True)
class KVPools:
    """Everything one endpoint registers: KV page buffers and aux slots.

    `kv` lists one region per layer and per K/V (any fixed order, the same
    on both sides); every region holds the same number of pages. `aux`
    lists the metadata buffers, indexed by an aux slot per request rather
    than by page (SGLang's `aux_data_ptrs`); each aux region's
    `page_nbytes` is the size of one slot.
    """

    kv: tuple[MemoryRegion, ...] = attrs.field(converter=_regions)
    aux: tuple[MemoryRegion, ...] = attrs.field(default=(), converter=_regions)

    def __attrs_post_init__(self) -> None:
        if not self.kv:
            raise ValueError("KVPools needs at least one KV region")
        pages = {region.num_pages for region in self.kv}
        if len(pages) != 1:
            detail = ", ".join(f"{r.name or hex(r.ptr)}={r.num_pages}" for r in self.kv)
            raise ValueError(f"every KV region must hold the same number of pages; got {detail}")
        slots = {region.num_pages for region in self.aux}
        if len(slots) > 1:
            detail = ", ".join(f"{r.name or hex(r.ptr)}={r.num_pages}" for r in self.aux)
            raise ValueError(f"every aux region must hold the same number of slots; got {detail}")

    @property
    def num_pages(self) -> int:
        return self.kv[0].num_pages

    @property
    def num_aux_slots(self) -> int:
        return self.aux[0].num_pages if self.aux else 0

    @property
    def page_nbytes(self) -> int:
        """Bytes one page index moves: the sum over all KV regions."""
        return sum(region.page_nbytes for region in self.kv)

    @property
    def layout(self) -> tuple[tuple[int, str | None], ...]:
        """(bytes per page, dtype) per KV region: both sides must agree on it."""
        return tuple((region.page_nbytes, region.dtype) for region in self.kv)

    def layout_mismatch(self, other: KVPools) -> str | None:
        """Why `other` cannot exchange pages with this pool, or None if it can."""
        if len(self.kv) != len(other.kv):
            return f"{len(self.kv)} KV regions here, {len(other.kv)} on the peer"
        for index, (mine, theirs) in enumerate(zip(self.kv, other.kv, strict=True)):
            if mine.page_nbytes != theirs.page_nbytes:
                return f"KV region {index} ({mine.name or '?'}): {mine.page_nbytes} bytes per page here, {theirs.page_nbytes} on the peer"
            if mine.dtype is not None and theirs.dtype is not None and mine.dtype != theirs.dtype:
                return f"KV region {index} ({mine.name or '?'}): dtype {mine.dtype} here, {theirs.dtype} on the peer"
        if len(self.aux) != len(other.aux):
            return f"{len(self.aux)} aux regions here, {len(other.aux)} on the peer"
        for index, (mine, theirs) in enumerate(zip(self.aux, other.aux, strict=True)):
            if mine.page_nbytes != theirs.page_nbytes:
                return f"aux region {index}: {mine.page_nbytes} bytes per slot here, {theirs.page_nbytes} on the peer"
        return None

    @classmethod
    def from_tensors(cls, k: Any, v: Any, aux: Any = None) -> KVPools:
        """Describe K and V buffers given as per-layer lists or one [layers, pages, ...] tensor each.

        Regions are ordered k0, v0, k1, v1, ...; a stacked tensor is split
        into per-layer views (no copy). `aux` is one tensor [slots, ...] or
        a list of them.
        """
        ks, vs = _per_layer(k), _per_layer(v)
        if len(ks) != len(vs):
            raise ValueError(f"K has {len(ks)} layers but V has {len(vs)}")
        regions: list[MemoryRegion] = []
        for layer, (kt, vt) in enumerate(zip(ks, vs, strict=True)):
            regions.append(MemoryRegion.of_tensor(kt, f"k{layer}"))
            regions.append(MemoryRegion.of_tensor(vt, f"v{layer}"))
        aux_list = [] if aux is None else (list(aux) if isinstance(aux, (list, tuple)) else [aux])
        return cls(regions, tuple(MemoryRegion.of_tensor(t, f"aux{i}") for i, t in enumerate(aux_list)))


def _per_layer(buffers: Any) -> list[Any]:
    if isinstance(buffers, (list, tuple)):
        return list(buffers)
    # A stacked [layers, pages, ...] tensor: one view per layer.
    return list(buffers.unbind(0))


def is_index(value: object) -> bool:
    """An int (not a bool), or a numpy/torch integer scalar: never a float or a str."""
    if value.__class__ is int:
        return True
    if isinstance(value, (bool, float, str, bytes)):
        return False
    if isinstance(value, int):
        return True
    # numpy.int64 and friends: integer by dtype, exact under __index__.
    dtype = getattr(value, "dtype", None)
    return (
        dtype is not None
        and str(dtype).removeprefix("torch.").startswith(("int", "uint"))
        and hasattr(value, "__index__")
    )


def check_pages(room: Hashable, pages: Iterable[int], limit: int, what: str, *, unique: bool = False) -> list[int]:
    """Validate page (or aux slot) indices: integers in [0, limit), unique if asked. Returns them as a list.

    Integers only (numpy integer types too): `1.9` is refused, not rounded to
    page 1, and neither `"2"` nor `True` stands for a page. Destination pages
    are `unique`: two of a room's chunks landing in one page would make its
    KV wrong whatever the order. Raises `TransferInputError` naming the room
    and the first bad index.
    """
    checked: list[int] = []
    for position, page in enumerate(pages):
        if not is_index(page):
            raise TransferInputError(
                room, f"{what}[{position}] must be an integer page index; got {type(page).__name__}: {page!r:.40}"
            )
        checked.append(page.__index__())
    for position, page in enumerate(checked):
        if not 0 <= page < limit:
            raise TransferInputError(
                room, f"{what}[{position}] = {page} is out of range: the pool has {limit} (valid 0..{limit - 1})"
            )
    if unique and len(set(checked)) != len(checked):
        seen: set[int] = set()
        for position, page in enumerate(checked):
            if page in seen:
                raise TransferInputError(
                    room, f"{what}[{position}] = {page} appears twice: each page may receive only one page of KV"
                )
            seen.add(page)
    return checked


def as_index_list(room: Hashable, pages: Any, what: str) -> Sequence[Any]:
    """Accept a list/tuple/range of ints, a 1-D integer tensor or numpy array."""
    if isinstance(pages, (list, tuple, range)):
        return pages
    dtype = getattr(pages, "dtype", None)
    if dtype is not None:
        kind = str(dtype).removeprefix("torch.")
        if not any(kind.startswith(prefix) for prefix in ("int", "uint")):
            raise TransferInputError(room, f"{what} must have an integer dtype; got {kind}")
        if len(getattr(pages, "shape", ())) != 1:
            raise TransferInputError(room, f"{what} must be 1-D; got shape {tuple(pages.shape)}")
        return [int(p) for p in pages.tolist()]
    raise TransferInputError(room, f"{what} must be a sequence of ints; got {type(pages).__name__}")
